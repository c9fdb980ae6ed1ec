"""console lines on the main process only, named for the command the user ran."""

from __future__ import annotations

from bert_mp.core.process import console


def test_say_prints_on_the_main_process_only_with_the_command_name(monkeypatch, capsys):
    monkeypatch.setattr(console, "_COMMAND", ["train"])
    console.say("reusing data/x", command="prepare")
    console.say("hello")
    monkeypatch.setenv("RANK", "1")
    console.say("from the second process")
    console.show("bert-mp train: stopped")
    assert capsys.readouterr().out == "bert-mp prepare: reusing data/x\nbert-mp train: hello\n"
