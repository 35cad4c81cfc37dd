import msgpack

from hicached.warmup import WarmPage, load, save


def test_save_and_load_round_trip(tmp_path):
    pages = [WarmPage("ns.a", "k1", 4096, True), WarmPage("ns.b", "k2", 8192, False)]
    path = str(tmp_path / "sub" / "warm.msgpack")
    save(path, pages)
    assert load(path) == pages


def test_bad_lists_are_ignored(tmp_path):
    path = tmp_path / "warm.msgpack"
    assert load(str(path)) == []
    path.write_bytes(b"not msgpack \xc1")
    assert load(str(path)) == []
    path.write_bytes(msgpack.packb({"format": 99, "pages": []}))
    assert load(str(path)) == []
    # Entries with names that are not safe are dropped, the rest kept.
    good, bad = ["ns", "k", 4096, False], ["../etc", "k", 4096, False]
    path.write_bytes(
        msgpack.packb({"format": 1, "pages": [bad, good, ["ns", "a/b", 1, 0], ["ns", "k2", -1, 0]]})
    )
    assert load(str(path)) == [WarmPage("ns", "k", 4096, False)]
    assert load(str(path), max_bytes=4) == []
