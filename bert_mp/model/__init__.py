"""The pretraining model: BertForPreTraining presets, the loss wrapper, fast CPU dropout."""
