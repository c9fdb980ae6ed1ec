"""``bert-mp finetune``: sequence classification from an exported checkpoint."""
