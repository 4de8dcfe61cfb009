"""The sizes of the tiny Llama that tests and launched test scripts build, each with its own
vocabulary and positions. A module that imports nothing: the CPU reference runs (torchrun, the
stock Trainer) import it without importing accel_xla_fsdp."""

TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
