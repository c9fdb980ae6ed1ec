"""Figures the docs show, made from real runs: :mod:`.plot_headline` (the README's picture from a sweep
folder)."""
