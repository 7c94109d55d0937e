"""Property-based fuzzing (hypothesis) of the parsers that take bytes from the network.

Each property is bounded so that the directory runs in seconds; ``FUZZ_SCALE=20 pytest
tests/fuzz`` multiplies every ``max_examples`` for a longer hunt.
"""
