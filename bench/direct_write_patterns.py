#!/usr/bin/env python3
"""Raw O_DIRECT write patterns against whole 16 MiB writes, each followed by fdatasync, as the
ingest of 2 MB images writes a segment. It asks whether the shape of Sluice's group commits
slows the disk:

- iovecs: eight 2 MiB iovecs from separate huge-page mappings at 4 KiB offsets (placed batches
  gathered by one group commit) against one contiguous huge-page buffer;
- split: groups of 16 MiB + 1,234 bytes, the partial blocks at both ends written through the
  page cache on a second descriptor and the aligned middle direct, as `DirectFile` writes;
- busy: the plain loop while two other processes keep both cores busy;
- loopback: the plain loop while another process streams 2 MiB writes to itself over a loopback
  TCP connection as fast as it can, the copies an ingest over loopback makes next to its disk
  writes (its rate is printed too).

Usage: python3 bench/direct_write_patterns.py [DIR] (default target/bench-disk; 3.2 GB per
loop, four rounds, the file is removed after each loop).
"""
import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time

HUGE = 2 << 20
BLOCK = 4096
GROUP = 16 << 20
TOTAL = 3200 << 20


def huge(n):
    """n bytes of a mapping aligned to 2 MiB and advised MADV_HUGEPAGE, touched."""
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    off = (-addr) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, off, n)
    view = memoryview(m)[off:off + n]
    view[:] = b"q" * n
    return m, view


def loop(path, write_group):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    buffered = os.open(path, os.O_WRONLY)
    start = time.time()
    written = 0
    while written < TOTAL:
        written += write_group(fd, buffered, written)
        os.fdatasync(fd)
    took = time.time() - start
    os.close(fd)
    os.close(buffered)
    os.unlink(path)
    return written / took / 1e6


# One loopback TCP stream of 2 MiB writes, read into one 2 MiB buffer; prints the bytes
# received so far and the seconds since it began, ten times a second.
STREAM = r'''
import socket, sys, threading, time
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
port = srv.getsockname()[1]
def send():
    c = socket.create_connection(("127.0.0.1", port))
    chunk = b"x" * (2 << 20)
    while True:
        c.sendall(chunk)
threading.Thread(target=send, daemon=True).start()
s, _ = srv.accept()
buf = bytearray(2 << 20)
got = 0
began = mark = time.time()
while True:
    got += s.recv_into(buf)
    if time.time() - mark >= 0.1:
        mark = time.time()
        print(got, mark - began, flush=True)
'''


def with_stream(run):
    """run() while a loopback stream runs in another process; (its result, stream MB/s)."""
    stream = subprocess.Popen([sys.executable, "-c", STREAM], stdout=subprocess.PIPE, text=True)
    try:
        result = run()
    finally:
        stream.send_signal(signal.SIGKILL)
        lines = stream.communicate()[0].splitlines()
    if not lines:
        return result, 0.0
    got, seconds = lines[-1].split()
    return result, int(got) / float(seconds) / 1e6


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "target/bench-disk"
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "patterns.bin")
    _, one = huge(GROUP + 2 * BLOCK + HUGE)
    parts = []
    for i in range(8):
        _, view = huge(4 << 20)
        shift = BLOCK * (1 + (i * 37) % 500)
        parts.append(view[shift:shift + (2 << 20)])

    def whole(fd, _buffered, _pos):
        return os.writev(fd, [one[:GROUP]])

    def iovecs(fd, _buffered, _pos):
        return os.writev(fd, parts)

    def split(fd, buffered, pos):
        size = GROUP + 1234
        end = pos + size
        head = (-pos) % BLOCK
        middle_end = end - end % BLOCK
        # The batch's memory agrees with its file position modulo 4 KiB.
        base = pos % BLOCK
        if head:
            os.pwrite(buffered, one[base:base + head], pos)
        os.pwrite(fd, one[base + head:base + middle_end - pos], pos + head)
        if end > middle_end:
            os.pwrite(buffered, one[base + middle_end - pos:base + size], middle_end)
        return size

    for _ in range(4):
        plain = loop(path, whole)
        gathered = loop(path, iovecs)
        plain_again = loop(path, whole)
        split_groups = loop(path, split)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            busy = loop(path, whole)
        finally:
            for b in burners:
                b.kill()
        streamed, stream_rate = with_stream(lambda: loop(path, whole))
        print(
            f"whole {plain:.0f} | iovecs {gathered:.0f} | whole {plain_again:.0f} | "
            f"split {split_groups:.0f} | whole, cores busy {busy:.0f} | "
            f"whole, loopback stream {streamed:.0f} (stream {stream_rate:.0f}) MB/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
