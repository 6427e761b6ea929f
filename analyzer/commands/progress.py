"""A progress bar while a large input is read: polls the position of the file the reader opened."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from analyzer.ingest.sniff import OPEN_LISTENERS

MIN_BYTES_FOR_BAR = 32 * 2**20


@contextmanager
def reading_progress(console: Console, enabled: bool) -> Iterator[None]:
    """Show a bar for every input of at least MIN_BYTES_FOR_BAR opened inside the block."""
    if not enabled:
        yield
        return
    progress = Progress(TextColumn("reading"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                        console=console, transient=True)
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def poll(stream: IO[bytes], fd: int, task: TaskID) -> None:
        # the OS file offset, not stream.tell(): the reader holds the buffered file's lock while it reads
        while not stop.wait(0.2) and not stream.closed:
            try:
                progress.update(task, completed=os.lseek(fd, 0, os.SEEK_CUR))
            except OSError:
                return

    def on_open(stream: IO[bytes], size: int) -> None:
        if size >= MIN_BYTES_FOR_BAR:
            task = progress.add_task("read", total=size)
            thread = threading.Thread(target=poll, args=(stream, stream.fileno(), task), daemon=True)
            thread.start()
            threads.append(thread)

    OPEN_LISTENERS.append(on_open)
    try:
        with progress:
            yield
    finally:
        stop.set()
        OPEN_LISTENERS.remove(on_open)
        for thread in threads:
            thread.join()
