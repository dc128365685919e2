"""
One client address attacking a server on 127.0.0.1, from 127.0.0.2 (Linux routes all of 127.0.0.0/8 to loopback),
in a process of its own: the server's process must not pay for its attacker's work. Launched by tests/test_serve.py
as

    python -m tests.support.attackers PORT SECONDS

Four threads trickle a request's headers, one byte every 1.5 s, and reconnect once answered (a 408, or a 503 at a
cap); two threads open a connection every 0.3 s that asks for a long streamed answer of 8 rows and never reads it.
After SECONDS it prints, as one JSON line, the first line and error message of every answer the slow ones got.
"""

import json
import select
import socket
import sys
import threading

ATTACKER = "127.0.0.2"
HEADERS = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


def connect(port, receive_buffer=None):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connecting: it sets the window
    sock.settimeout(5)
    sock.bind((ATTACKER, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def slow_headers(port, stop, answers):
    while not stop.is_set():
        try:
            with connect(port) as sock:
                for byte in HEADERS + b"\r\n":
                    sock.send(bytes([byte]))
                    if select.select([sock], [], [], 1.5)[0]:
                        answers.append(sock.recv(4096).decode("latin-1"))
                        break
                    if stop.is_set():
                        break
        except OSError:  # reset before its answer could be read
            pass
        stop.wait(0.05)


def non_reader(port, stop, sockets):
    raw = json.dumps({"prompt": "the", "max_tokens": 32, "n": 8, "stream": True}).encode()
    while not stop.is_set():
        try:
            sock = connect(port, receive_buffer=4096)
            sockets.append(sock)
            sock.sendall(HEADERS + b"content-length: %d\r\n\r\n" % len(raw) + raw)
        except OSError:  # refused at the cap and closed as it sent
            pass
        stop.wait(0.3)


def main(port, seconds):
    stop, answers, sockets = threading.Event(), [], []
    threads = [threading.Thread(target=slow_headers, args=(port, stop, answers)) for _ in range(4)]
    threads += [threading.Thread(target=non_reader, args=(port, stop, sockets)) for _ in range(2)]
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    for sock in sockets:
        sock.close()
    print(json.dumps([answer.split("\r\n")[0] + " " + answer.rpartition("\r\n\r\n")[2] for answer in answers]))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
