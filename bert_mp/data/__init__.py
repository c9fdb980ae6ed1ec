"""Raw text to NSP + MLM pretraining data: corpus reading, sentences, pairs, masking, tokenizer."""
