"""bert_mp: BERT pretraining with Hugging Face, built for mixed-precision work."""

__version__ = "0.1.0"
