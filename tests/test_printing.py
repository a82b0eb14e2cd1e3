import builtins

from my_utils.core import printing


def test_rank_print_prefixes_every_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    printing.rank_print("a\nb", 3)
    assert capsys.readouterr().out == "[rank 1/2] a\n[rank 1/2] b 3\n"


def test_rank_print_is_one_write_per_call(monkeypatch):
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    printing.rank_print("x\ny", file=Stream())
    assert len(writes) == 1 and writes[0].count("\n") == 2


def test_print0_only_on_rank0(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    printing.print0("hidden")
    monkeypatch.setenv("RANK", "0")
    printing.print0("shown")
    assert capsys.readouterr().out == "shown\n"


def test_install_and_restore(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    original = builtins.print
    restore = printing.install_rank_print()
    try:
        print("hello")
        assert builtins.print is not original
    finally:
        restore()
    assert builtins.print is original
    print("plain")
    assert capsys.readouterr().out == "[rank 0/4] hello\nplain\n"
