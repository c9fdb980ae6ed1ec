"""Drills that break a real run on purpose and check what survives: :mod:`.fault` (kill a training
process at random points, resume, compare with an uninterrupted run) and :mod:`.bitflip` (flip bits in
saved checkpoints: every flip is found before anything loads). Run each as
``python scripts/drills/<name>.py``."""
