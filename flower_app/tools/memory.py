"""Peak memory of this process and every process it started (the simulation engine's workers
included), sampled in a background thread while a benchmark runs."""

from __future__ import annotations

import threading

import psutil

MB = 1 << 20


class TreeMemory:
    """Samples, every ``interval`` seconds, the memory summed over this process's tree: RSS
    (shared pages counted once per process that maps them) and PSS (shared pages split between
    those processes; Linux only, else None). Use as a context manager; read :meth:`report`."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak_rss = 0
        self.peak_pss: int | None = None
        self.peak_processes = 0
        self.largest: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flrep-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One reading of the tree; updates the peaks."""
        root = psutil.Process()
        rss, pss, sizes = 0, 0, []
        for proc in [root, *root.children(recursive=True)]:
            try:
                info = proc.memory_full_info()  # with pss on Linux
                name = " ".join(proc.cmdline()[:2])[-60:] or proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            sizes.append((name, info.rss))
            pss = None if pss is None or not hasattr(info, "pss") else pss + info.pss
        if rss > self.peak_rss:
            self.peak_rss, self.peak_processes = rss, len(sizes)
            self.largest = sorted(sizes, key=lambda s: -s[1])[:5]
        if pss is not None and (self.peak_pss is None or pss > self.peak_pss):
            self.peak_pss = pss

    def report(self) -> dict:
        """Peaks in MiB, and the five largest processes at the RSS peak."""
        return {"peak_rss_tree_mb": round(self.peak_rss / MB), "peak_pss_tree_mb":
                None if self.peak_pss is None else round(self.peak_pss / MB),
                "processes_at_peak": self.peak_processes,
                "largest_at_peak_mb": [[name, round(rss / MB)] for name, rss in self.largest]}
