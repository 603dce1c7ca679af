#!/usr/bin/env python3
"""A TCP listener on 127.0.0.1 that accepts every connection and never answers: a hung pool.

Prints its port on the first line of stdout, then holds the accepted sockets open until killed.
Used by the worker's shell tests (runtime_cli_test.sh, stop_signal_test.sh).
"""
import socket

s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
print(s.getsockname()[1], flush=True)
held = []
while True:
    held.append(s.accept()[0])
