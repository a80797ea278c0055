"""The peer benchmark's timing (torch, CUDA) and bandwidth ceilings.

A case's timed calls (each reading its own region of the pool, or its own random top-k slots)
are captured once into a CUDA graph; each repeat replays the graph between two events, after an
L2 flush outside the events, so no call finds another's bytes (or its own from the last repeat)
in L2. Time per call = the median repeat / the calls. Every peer is timed this way.
"""

import statistics


def l2_flush_bytes(torch, device):
    """Twice the device's L2 (at least 128 MB): zeroing this evicts what a call left there."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    return max(2 * l2, 128 << 20)


def time_calls(torch, runs, reps, flush):
    """Median microseconds per call of `runs` (callables launching on the current stream),
    replayed as one CUDA graph `reps` times, `flush` (a uint8 device tensor) zeroed before each
    replay outside the timed events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (lazy inits, allocator)
        for run in runs:
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del graph
    return 1e3 * ms / len(runs)


def measure_ceilings(torch, device, nbytes=4 << 30, reps=10):
    """Bandwidth ceilings in GB/s over `nbytes` of fresh device memory (far larger than L2):
    copy (y.copy_(x) over two halves, read + write bytes counted) and a streaming read (sum of
    the first half viewed as float32: one read, a scalar written). Medians of `reps` runs."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    half = nbytes // 2
    x, y = buf[:half], buf[half:2 * half]
    xf = x.view(torch.float32)

    def median_ms(fn):
        fn()
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(reps)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs)

    copy_gbs = 2 * half / (median_ms(lambda: y.copy_(x)) * 1e6)
    read_gbs = half / (median_ms(lambda: xf.sum()) * 1e6)
    del buf
    torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "sum_read_gbs": read_gbs,
            "read_ceiling_gbs": max(copy_gbs, read_gbs), "bytes": nbytes}
