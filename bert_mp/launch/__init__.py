"""``bert-mp launch``: :mod:`.command` (``accelerate launch`` for train / finetune, signals, exit
codes), :mod:`.report` (what the ranks said, as one line; launch.log) and :mod:`.machines` (several
machines' meeting in torch elastic's rendezvous). The rank's side of a launch is in
:mod:`bert_mp.core.process`."""
