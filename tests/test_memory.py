from my_utils.core import memory


def test_snapshot_cpu_has_rss_and_no_allocator_figures():
    s = memory.snapshot("cpu")
    assert s["rss"] > 10 * memory.MiB
    assert s["peak_rss"] >= s["rss"] * 0.9
    assert s["allocated"] is None and s["peak_allocated"] is None
    assert memory.peak_bytes(s) == s["peak_rss"]


def test_reset_peak_forgets_an_earlier_allocation():
    big = bytearray(300 * memory.MiB)
    big[:: 4096] = b"x" * len(big[:: 4096])  # touch every page so it is resident
    high = memory.snapshot()["peak_rss"]
    del big
    assert memory.reset_peak("cpu"), "this Linux kernel does not allow resetting the RSS high-water mark"
    after = memory.snapshot()["peak_rss"]
    assert after < high - 200 * memory.MiB


def test_format_bytes():
    assert memory.format_bytes(None) == "-"
    assert memory.format_bytes(512) == "512 B"
    assert memory.format_bytes(3 * memory.MiB // 2) == "1.5 MiB"
    assert memory.format_bytes(2 * memory.GiB) == "2.0 GiB"
