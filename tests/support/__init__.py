"""What the test modules share (helpers, process handling, failing writes, a tiny trained checkpoint) and the
workers they launch under torchrun; no tests here, so pytest collects nothing from this package."""
