"""``bert-mp train``: pretraining BertForPreTraining."""
