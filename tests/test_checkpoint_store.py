"""Checkpoints in buckets and without a shared filesystem ([Note: committing a save]).

A real S3 API server runs on localhost for the module (moto's server mode, as s3fs's own tests
use it); fsspec's memory filesystem carries the protocol tests that need no device, and a
fault-injecting one (tests/stores.py) the store failures. Two hosts without a shared filesystem
are simulated by ``host://``: replicas 0-1 and 2-3 each write into a folder of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from contextlib import nullcontext
from typing import Any, Dict, Iterator, List
from unittest import mock

import fsspec
import pytest
import torch
from models import LLAMA_CONFIG, build, compute_loss, global_batch, local_slice, wrap
from safetensors.torch import load_file
from stores import FaultyFileSystem, HostFileSystem, free_port, permanent, transient, use_s3
from transformers import LlamaConfig, LlamaForCausalLM

from accel_xla_fsdp import (
    CheckpointError,
    ReplicaError,
    ShardedCheckpoint,
    _xla,
    cli,
    load_sharded,
    save_sharded,
    seeded,
)
from accel_xla_fsdp.checkpoint import sharded, store
from accel_xla_fsdp.checkpoint.format import find_saves
from accel_xla_fsdp.xla_cpu.rendezvous import agree

MODEL = "llama"
LAYOUT = {"flatten_parameters": True}
BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """The endpoint of an S3 API server on localhost with a bucket ``ckpts``, for the module."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    use_s3(endpoint)
    fsspec.filesystem("s3").mkdir(BUCKET)
    yield endpoint
    server.stop()


def fresh(prefix: str) -> str:
    """A prefix no earlier attempt used: a test run again after a device process's SIGSEGV
    (pyproject's --reruns) must not find the files of its first attempt in the module's bucket."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def bucket_files(prefix: str) -> List[str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(p[len(f"{BUCKET}/{prefix}/") :] for p in fs.find(f"{BUCKET}/{prefix}"))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: Any, optimizer: Any, rank: int, world: int, steps: range) -> None:
    for step in steps:
        x, _ = (t.to(_xla.device()) for t in local_slice(global_batch(MODEL, step, 0, world), rank))
        compute_loss(MODEL, model, x, x).backward()
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()


def model_and_optimizer(rank: int, world: int) -> Any:
    model = wrap(MODEL, build(MODEL), rank, world, LAYOUT)
    return model, adamw(model)


# ---------------------------------------------------------------------------------------------
# Save to a bucket, resume bit for bit, reshard, consolidate from it


def save_train_on(rank: int, world: int, endpoint: str, url: str) -> Dict[str, Any]:
    """One step, a save into ``url``, one more step: the state saved and the state after."""
    use_s3(endpoint)
    model, optimizer = model_and_optimizer(rank, world)
    train(model, optimizer, rank, world, range(1))
    save_sharded(model, optimizer, url)
    saved = model.full_state_dict()
    train(model, optimizer, rank, world, range(1, 2))
    return {"saved": saved, "after": model.full_state_dict()}


def load_train_on(rank: int, world: int, endpoint: str, url: str) -> Dict[str, Any]:
    use_s3(endpoint)
    model, optimizer = model_and_optimizer(rank, world)
    load_sharded(model, optimizer, url)
    loaded = model.full_state_dict()
    train(model, optimizer, rank, world, range(1, 2))
    return {"loaded": loaded, "after": model.full_state_dict()}


def assert_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def in_bucket(pools, s3) -> Dict[str, Any]:
    prefix = fresh("run/ckpt")
    url = f"s3://{BUCKET}/{prefix}"
    return {"url": url, "prefix": prefix, **pools[2].run(save_train_on, 2, s3, url)[0]}


def test_a_save_into_a_bucket_resumes_bit_for_bit_and_reshards(pools, s3, in_bucket, tmp_path, monkeypatch) -> None:
    assert bucket_files(in_bucket["prefix"]) == [
        "save-000000/checkpoint.json",
        "save-000000/rank-00000-of-00002.safetensors",
        "save-000000/rank-00001-of-00002.safetensors",
        "save-000000/started.json",
    ]
    resumed = pools[2].run(load_train_on, 2, s3, in_bucket["url"])[0]
    assert_equal(resumed["loaded"], in_bucket["saved"])
    assert_equal(resumed["after"], in_bucket["after"])  # training on is as never stopping, bit for bit
    assert_equal(pools[4].run(load_train_on, 4, s3, in_bucket["url"])[0]["loaded"], in_bucket["saved"])  # 2 -> 4


def test_a_url_is_never_a_local_path(s3, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"nosuch://b/x: not a location fsspec knows \(Protocol not known"):
        ShardedCheckpoint("nosuch://b/x")
    with pytest.raises(CheckpointError, match=r"s3://ckpts/nothing: no checkpoint.json"):
        ShardedCheckpoint(f"s3://{BUCKET}/nothing")
    assert list(tmp_path.iterdir()) == []


def test_consolidate_streams_from_the_bucket_into_a_folder_and_a_bucket(s3, in_bucket, tmp_path, monkeypatch) -> None:
    reads: List[int] = []
    real = store.Location.read_range
    monkeypatch.setattr(store.Location, "read_range", lambda self, a, b: (reads.append(b - a), real(self, a, b))[1])
    config = tmp_path / "config"
    LlamaConfig(**LLAMA_CONFIG).save_pretrained(config)
    out = tmp_path / "out"
    assert cli.main(["consolidate", in_bucket["url"], str(out), "--config", str(config), "--no-progress"]) == 0
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) <= set(in_bucket["saved"])  # every parameter (the model's rotary buffers are not saved)
    assert_equal(loaded, {k: in_bucket["saved"][k] for k in loaded})
    # Ranged reads only: headers, then pieces of tensors (the checksums' reads are one buffer).
    assert reads and max(reads) <= 32 * 2**20
    ranks = [f for f in bucket_files(in_bucket["prefix"]) if "rank" in f]
    size = sum(fsspec.filesystem("s3").size(f"{BUCKET}/{in_bucket['prefix']}/{f}") for f in ranks)
    assert max(reads) < size / 2
    hf = fresh("run/hf")
    url = f"s3://{BUCKET}/{hf}"
    assert cli.main(["consolidate", in_bucket["url"], url, "--config", str(config), "--no-progress"]) == 0
    assert bucket_files(hf) == ["config.json", "model.safetensors"]
    fsspec.filesystem("s3").get(f"{BUCKET}/{hf}/model.safetensors", str(tmp_path / "m.safetensors"))
    assert_equal(load_file(tmp_path / "m.safetensors"), load_file(out / "model.safetensors"))
    # A bucket location holding a model is refused (it cannot be replaced all at once).
    code = cli.main(["consolidate", in_bucket["url"], url, "--overwrite", "--no-progress"])
    assert code == 1


# ---------------------------------------------------------------------------------------------
# A save killed in a bucket


def save_killed(rank: int, world: int, endpoint: str, url: str, point: str) -> None:
    use_s3(endpoint)
    model, optimizer = model_and_optimizer(rank, world)
    train(model, optimizer, rank, world, range(1))
    save_sharded(model, optimizer, url)
    train(model, optimizer, rank, world, range(1, 2))
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if point == "uploading rank files":
        real = sharded.write_rank_file
        sharded.write_rank_file = lambda f, *args: (real(f, *args), die())  # before the upload completes
    elif point == "before the commit":
        sharded._commit = die
    elif point == "after the commit":
        sharded._remove_save = die
    save_sharded(model, optimizer, url)


def load_then_save(rank: int, world: int, endpoint: str, url: str) -> Dict[str, torch.Tensor]:
    use_s3(endpoint)
    model, optimizer = model_and_optimizer(rank, world)
    load_sharded(model, optimizer, url)
    state = model.full_state_dict()
    save_sharded(model, optimizer, url)
    return state


@pytest.mark.parametrize("point", ["uploading rank files", "before the commit", "after the commit"])
def test_a_save_killed_in_a_bucket_leaves_the_previous_one_and_the_next_cleans_up(pools, s3, in_bucket, point) -> None:
    url = f"s3://{BUCKET}/{fresh('killed/' + point.replace(' ', '-'))}"
    with pytest.raises(ReplicaError, match="SIGKILL"):
        pools[2].run(save_killed, 2, s3, url, point)
    found = find_saves(url)
    assert found.record.save_id == ("save-000001" if point == "after the commit" else "save-000000")
    assert found.incomplete == (() if point == "after the commit" else ("save-000001",))
    loaded = pools[2].run(load_then_save, 2, s3, url)[0]
    assert_equal(loaded, in_bucket["after"] if point == "after the commit" else in_bucket["saved"])
    last = find_saves(url).record.save_id
    assert bucket_files(url.removeprefix(f"s3://{BUCKET}/")) == [
        f"{last}/checkpoint.json",
        f"{last}/rank-00000-of-00002.safetensors",
        f"{last}/rank-00001-of-00002.safetensors",
        f"{last}/started.json",
    ]


# ---------------------------------------------------------------------------------------------
# save_state killed, on a local disk and in a bucket: one protocol ([Note: save_state folders])


def files_under(where: str) -> List[str]:
    fs, path = fsspec.core.url_to_fs(where)
    fs.invalidate_cache()
    return sorted(str(p)[len(path.rstrip("/")) + 1 :] for p in fs.find(path))


def state_round(rank: int, world: int, endpoint: str, folder: str, seed: int, kill: str = "") -> Any:
    """save_state of a model drawn from ``seed`` into ``folder`` (dying with SIGKILL at ``kill``),
    or with ``seed`` None load_state of it: the model's state (or the refusal)."""
    from accel_xla_fsdp import Accelerator
    from accel_xla_fsdp.hf_accelerate import accelerate_files, checkpoints

    use_s3(endpoint)
    acc = Accelerator()
    torch.manual_seed(seed or 0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    if seed is None:
        acc.load_state(folder)
        return acc.get_state_dict(model)
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if kill == "writing Accelerate's files":  # every rank file of xla_fsdp_0/ written and committed
        accelerate_files._put = die
    elif kill == "before the record":
        checkpoints._commit = die
    elif kill == "after the record":  # the previous save not removed yet
        checkpoints._remove_state = die
    acc.save_state(folder)
    return acc.get_state_dict(model)


def ours(state: str) -> List[str]:
    return [
        f"{state}/random_states_0.pkl",
        f"{state}/random_states_1.pkl",
        f"{state}/started.json",
        *(f"{state}/xla_fsdp_0/save-000000/{f}" for f in ("checkpoint.json", "rank-00000-of-00002.safetensors")),
        *(f"{state}/xla_fsdp_0/save-000000/{f}" for f in ("rank-00001-of-00002.safetensors", "started.json")),
    ]


# Each kill restarts the pool's process (about 25 s a case): the points are shared out between a
# local disk and the bucket, which run one code path.
KILLS = [
    ("local", "writing Accelerate's files"),
    ("local", "after the record"),
    ("bucket", "before the record"),
    ("bucket", "after the record"),
]


@pytest.mark.parametrize("where, point", KILLS, ids=lambda v: v.replace(" ", "_").replace("'", ""))
def test_a_killed_save_state_leaves_the_previous_one_and_the_next_cleans_up(pools, s3, tmp_path, where, point) -> None:
    bucket = f"s3://{BUCKET}/{fresh('state/' + point.replace(' ', '-'))}"
    folder = str(tmp_path / "state") if where == "local" else bucket
    fs, path = fsspec.core.url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)  # a bucket has no folders: nothing to make there
    fs.pipe_file(f"{path}/notes.txt", b"the user's")
    first = pools[2].run(state_round, 2, s3, folder, 1)[0]
    with pytest.raises(ReplicaError, match="SIGKILL"):
        pools[2].run(state_round, 2, s3, folder, 2, point)
    committed = point == "after the record"
    loaded = pools[2].run(state_round, 2, s3, folder, None)[0]
    if committed:
        assert not torch.equal(loaded["0.weight"], first["0.weight"])  # the second save's model
    else:
        assert_equal(loaded, first)
    third = pools[2].run(state_round, 2, s3, folder, 3)[0]
    assert_equal(pools[2].run(state_round, 2, s3, folder, None)[0], third)
    assert files_under(folder) == ["accel_xla_fsdp_state.json", "notes.txt", *ours("state-000002")]
    assert json.loads(fs.cat_file(f"{path}/accel_xla_fsdp_state.json")) == {"state": "state-000002"}


# ---------------------------------------------------------------------------------------------
# Store failures: transient ones retried, permanent ones end the save at once


def save_through_faults(rank: int, world: int) -> Dict[str, Any]:
    """faulty:// (memory): a save with transient failures planned, then one with a permanent
    failure, then one whose transient failures do not stop; each outcome, and what loads."""
    model, optimizer = model_and_optimizer(rank, world)
    url = "faulty://faults/ckpt"
    out: Dict[str, Any] = {}
    if rank == 0:
        FaultyFileSystem.plan(write=(3, transient), list=(2, transient))
    agree("planned")
    save_sharded(model, optimizer, url)
    agree("saved")
    out["injected"] = dict(FaultyFileSystem.injected)
    saved = model.full_state_dict()
    train(model, optimizer, rank, world, range(1))
    for name, faults in {
        "permanent": dict(write=(-1, permanent)),
        "transient for ever": dict(write=(-1, transient)),
    }.items():
        if rank == 0:
            FaultyFileSystem.plan(**faults)
        agree(f"planned {name}")
        try:
            save_sharded(model, optimizer, url)
            out[name] = "saved"
        except CheckpointError as e:
            out[name] = str(e)
        agree(f"failed {name}")
    if rank == 0:
        FaultyFileSystem.plan(read=(2, transient), list=(1, transient))
    agree("planned reads")
    model, optimizer = model_and_optimizer(rank, world)
    load_sharded(model, optimizer, url)
    agree("loaded")
    out["injected on load"] = dict(FaultyFileSystem.injected)
    out["loaded"] = model.full_state_dict()
    out["saved"] = saved
    out["files"] = sorted(k for k in FaultyFileSystem.store if k.startswith("/faults/ckpt/"))
    return out


def test_transient_failures_are_retried_and_permanent_ones_end_the_save(pools) -> None:
    results = pools[2].run(save_through_faults, 2)
    first = results[0]
    assert first["injected"] == {"write": 3, "list": 2}
    assert first["injected on load"] == {"read": 2, "list": 1}
    assert first["permanent"] == (
        "faulty://faults/ckpt/save-000001/started.json: cannot write it (PermissionError: [Errno 13] Access "
        "Denied (injected))"
    )
    assert results[1]["permanent"] == (
        "faulty://faults/ckpt: rank(s) [0] could not prepare the save (nothing was written); their own error says why"
    )
    assert "cannot write it: 5 attempts failed, the last with ConnectionResetError" in first["transient for ever"]
    for r in results:
        assert_equal(r["loaded"], first["saved"])  # the first save, intact
    assert [f.removeprefix("/faults/ckpt/") for f in first["files"]] == [
        "save-000000/checkpoint.json",
        "save-000000/rank-00000-of-00002.safetensors",
        "save-000000/rank-00001-of-00002.safetensors",
        "save-000000/started.json",
    ]


def save_read_only(rank: int, world: int, endpoint: str, url: str, key: Dict[str, str]) -> str:
    use_s3(endpoint)
    fsspec.config.conf["s3"].update(key=key["AccessKeyId"], secret=key["SecretAccessKey"], token=None)
    model, optimizer = model_and_optimizer(rank, world)
    try:
        save_sharded(model, optimizer, url)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_read_only_bucket_ends_the_save_naming_the_location(pools, s3, in_bucket) -> None:
    import boto3
    from moto import settings

    iam = boto3.client("iam", endpoint_url=s3)
    iam.create_user(UserName="reader")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}],
    }
    arn = iam.create_policy(PolicyName="read-only", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
    iam.attach_user_policy(UserName="reader", PolicyArn=arn)
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    before = bucket_files(in_bucket["prefix"])
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # the server checks every request's permissions from here
    try:
        messages = pools[2].run(save_read_only, 2, s3, in_bucket["url"], key)
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")
    assert (
        messages[0] == f"{in_bucket['url']}/save-000001/started.json: cannot write it (PermissionError: Access Denied)"
    )
    assert "rank(s) [0] could not prepare the save (nothing was written)" in messages[1]
    assert bucket_files(in_bucket["prefix"]) == before


# ---------------------------------------------------------------------------------------------
# Two hosts without a shared filesystem


def save_on_two_hosts(rank: int, world: int, hosts: str) -> str:
    os.environ["ACCEL_XLA_FSDP_TEST_HOSTS"] = hosts
    model, optimizer = model_and_optimizer(rank, world)
    save_sharded(model, optimizer, "host://ckpt")
    try:
        load_sharded(model, optimizer, "host://ckpt")
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_two_hosts_without_a_shared_filesystem(pools, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ACCEL_XLA_FSDP_TEST_HOSTS", str(tmp_path))
    assert HostFileSystem.RANKS_PER_HOST == 2
    messages = pools[4].run(save_on_two_hosts, 4, str(tmp_path))
    host0, host1 = tmp_path / "host0" / "ckpt" / "save-000000", tmp_path / "host1" / "ckpt" / "save-000000"
    assert sorted(p.name for p in host0.iterdir()) == [
        "checkpoint.json",
        "rank-00000-of-00004.safetensors",
        "rank-00001-of-00004.safetensors",
        "started.json",
    ]
    assert sorted(p.name for p in host1.iterdir()) == [
        "rank-00002-of-00004.safetensors",
        "rank-00003-of-00004.safetensors",
    ]
    missing = (
        "host://ckpt: 2 of the 4 rank files of save save-000000 are missing here: ranks 2-3 "
        "(rank-00002-of-00004.safetensors, rank-00003-of-00004.safetensors). Each host of a pod writes its own "
        "ranks' files: without a shared filesystem, save to a bucket (s3://, gs://) or copy every host's files "
        "into this folder"
    )
    assert messages[:2] == [missing, missing]
    assert (
        messages[2:]
        == ["host://ckpt: no checkpoint.json, so no complete checkpoint (a save that did not finish leaves none)"] * 2
    )
    assert cli.main(["consolidate", "host://ckpt", str(tmp_path / "out"), "--no-progress"]) == 1
    assert capsys.readouterr().err == f"accel-xla-fsdp consolidate: error: {missing}\n"
    for f in host1.iterdir():  # what the README says: copy every host's files together
        shutil.copy(f, host0)
    assert cli.main(["consolidate", "host://ckpt", str(tmp_path / "out"), "--no-progress"]) == 0


# ---------------------------------------------------------------------------------------------
# The protocol on the memory filesystem, no device


def test_loads_skip_an_incomplete_save_and_name_it(in_bucket, tmp_path, caplog) -> None:
    memory = fsspec.filesystem("memory")
    s3fs = fsspec.filesystem("s3")
    for f in bucket_files(in_bucket["prefix"]):
        memory.pipe_file(f"/incomplete/ckpt/{f}", s3fs.cat_file(f"{BUCKET}/{in_bucket['prefix']}/{f}"))
    for f in ("started.json", "rank-00000-of-00002.safetensors"):  # a newer save, killed midway
        memory.pipe_file(f"/incomplete/ckpt/save-000001/{f}", memory.cat_file(f"/incomplete/ckpt/save-000000/{f}"))
    ckpt = ShardedCheckpoint("memory://incomplete/ckpt")
    assert ckpt.save_id == "save-000000" and ckpt.skipped == ("save-000001",)
    assert "memory://incomplete/ckpt: skipping incomplete save(s) save-000001 (no checkpoint.json" in caplog.text
    memory.rm_file("/incomplete/ckpt/save-000000/checkpoint.json")
    with pytest.raises(CheckpointError) as e:
        ShardedCheckpoint("memory://incomplete/ckpt")
    assert str(e.value) == (
        "memory://incomplete/ckpt: no complete checkpoint: save-000001, save-000000 did not finish (no "
        "checkpoint.json in it); the next save removes what it wrote"
    )


# ---------------------------------------------------------------------------------------------
# Accelerate: save_state / load_state / save_model with URLs


def accelerate_in_bucket(rank: int, world: int, endpoint: str, project: str, local: str) -> Dict[str, Any]:
    """Three automatic saves with total_limit=2, a save_state and a save_model at URLs, then a
    fresh Accelerator's load_state() of the newest; a tied Llama's save_model to a URL (no
    temporary folder made meanwhile) and to the local folder ``local``."""
    from accelerate.utils import ProjectConfiguration

    from accel_xla_fsdp import Accelerator

    use_s3(endpoint)

    def accelerator() -> Any:
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
        acc = Accelerator(project_config=config)
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
        return acc, model

    acc, model = accelerator()
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    states = []
    for step in range(3):
        loss = model(torch.full((2, 4), float(step + 1), device=_xla.device())).square().sum()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        _xla.sync()
        acc.save_state()
        states.append(acc.get_state_dict(model))
    acc.save_model(model, f"{project}/model")
    acc, model = accelerator()
    acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.load_state()
    loaded = acc.get_state_dict(model)
    iteration = acc.project_configuration.iteration
    explicit = Accelerator()  # no automatic naming: save_state into the folder given, twice
    model = explicit.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    explicit.save_state(f"{project}/explicit")
    explicit.save_state(f"{project}/explicit")
    explicit.load_state(f"{project}/explicit")
    with seeded(0):
        llama = LlamaForCausalLM(LlamaConfig(**dict(LLAMA_CONFIG, tie_word_embeddings=True)))
    llama = explicit.prepare(llama)
    with (
        mock.patch("tempfile.mkdtemp", side_effect=AssertionError("a temporary folder"))
        if rank == 0
        else nullcontext()
    ):
        explicit.save_model(llama, f"{project}/llama", max_shard_size="40KB")
    explicit.save_model(llama, local, max_shard_size="40KB")
    return {
        "states": states,
        "loaded": loaded,
        "iteration": iteration,
        "explicit": explicit.get_state_dict(model),
        "local": os.path.exists("s3:") or os.path.exists(project),
    }


def test_accelerate_save_state_load_state_and_save_model_in_a_bucket(pools, s3, tmp_path) -> None:
    prefix = fresh("acc")
    project = f"s3://{BUCKET}/{prefix}"
    results = pools[2].run(accelerate_in_bucket, 2, s3, project, str(tmp_path / "llama"))
    first = results[0]
    assert not any(r["local"] for r in results)  # nothing written to a local ./s3:/ folder
    assert_equal(first["loaded"], first["states"][2])
    assert first["iteration"] == 3
    assert not torch.equal(first["states"][1]["0.weight"], first["states"][2]["0.weight"])
    files = bucket_files(prefix)
    folders = sorted({f.split("/")[1] for f in files if f.startswith("checkpoints/")})
    assert folders == ["checkpoint_1", "checkpoint_2"]  # total_limit=2: checkpoint_0 removed
    for folder in folders:
        ours = [f for f in files if f.startswith(f"checkpoints/{folder}/")]
        assert f"checkpoints/{folder}/accel_xla_fsdp_state.json" in ours
        assert f"checkpoints/{folder}/state-000000/xla_fsdp_0/save-000000/checkpoint.json" in ours
        assert f"checkpoints/{folder}/state-000000/random_states_1.pkl" in ours
    # Saved twice into one folder: the second save's folder, the first removed after its record.
    assert sorted(f for f in files if f.startswith("explicit/") and "/xla_fsdp_" not in f) == [
        "explicit/accel_xla_fsdp_state.json",
        "explicit/state-000001/random_states_0.pkl",
        "explicit/state-000001/random_states_1.pkl",
        "explicit/state-000001/started.json",
    ]
    assert "model/model.safetensors" in files
    # consolidate takes the folder given to save_state: its complete save's first model.
    assert cli.main(["consolidate", f"{project}/explicit", f"{project}/explicit-hf", "--no-progress"]) == 0
    assert bucket_files(f"{prefix}/explicit-hf") == ["model.safetensors"]
    # save_model of a transformers model to a URL: what the local save_model writes, file for file
    # (sharded: 40KB) and tensor for tensor, the tied lm_head left out; it loads.
    local = tmp_path / "llama"
    assert bucket_files(f"{prefix}/llama") == sorted(p.name for p in local.iterdir())
    assert "model.safetensors.index.json" in bucket_files(f"{prefix}/llama")
    fsspec.filesystem("s3").get(f"{BUCKET}/{prefix}/llama/", str(tmp_path / "from-bucket"), recursive=True)
    for name in bucket_files(f"{prefix}/llama"):
        if name.endswith(".safetensors"):
            assert_equal(load_file(tmp_path / "from-bucket" / name), load_file(local / name))
        else:  # the same JSON; the index's total_parameters that of the model (the local one counts shards)
            ours, stock = (json.loads((where / name).read_text()) for where in (tmp_path / "from-bucket", local))
            ours.get("metadata", {}).pop("total_parameters", None)
            stock.get("metadata", {}).pop("total_parameters", None)
            assert ours == stock, name
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "from-bucket")
    index = json.loads((tmp_path / "from-bucket" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == loaded.num_parameters()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_equal(loaded.state_dict(), LlamaForCausalLM.from_pretrained(local).state_dict())


def test_save_model_to_a_url_refuses_what_it_cannot_write_as_save_pretrained_would() -> None:
    """Custom code (its files are not copied) and models whose own save_pretrained is not
    transformers' (PEFT's): refused by name, before anything is gathered."""
    from accel_xla_fsdp.checkpoint.consolidate import check_storable

    url = store.Location.of("memory://models/x")
    custom = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    custom._auto_class = "AutoModelForCausalLM"  # as register_for_auto_class / trust_remote_code leave it
    with pytest.raises(CheckpointError, match=r"memory://models/x: LlamaForCausalLM is custom code \(auto_map\)"):
        check_storable(custom, url)

    class Adapter(torch.nn.Linear):
        def save_pretrained(self, folder: str) -> None: ...

    with pytest.raises(CheckpointError, match=r"writes transformers models and plain modules, not Adapter"):
        check_storable(Adapter(2, 2), url)
    check_storable(torch.nn.Linear(2, 2), url)
    check_storable(LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)), url)
