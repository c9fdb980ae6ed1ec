"""The shared training core: config tree, precision plans, checkpoints, callbacks, optimizer, files."""
