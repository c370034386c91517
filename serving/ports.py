"""Is a TCP port free to serve on? Checked before a model is loaded, so that a port in use
costs the user seconds, not a model load followed by a server's raw traceback.

    problem = port_problem("127.0.0.1", 7860, "--port")
    if problem: print(problem); exit(2)

The check binds the port the way the servers do (uvicorn and Gradio set SO_REUSEADDR, so a
port left in TIME_WAIT by a server that just stopped counts as free; one another process
listens on does not) and closes it at once. A server started later could still lose a race
for the port; it then reports the bind error itself.
"""

from __future__ import annotations

import errno
import socket


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_problem(host: str, port: int, flag: str) -> str | None:
    """None when `host:port` can be bound now; else one line saying why and which flag
    (`flag`, e.g. "--port") picks another port."""
    if not 0 <= port <= 65535:
        return f"{flag} {port}: a port is a number from 0 to 65535 (0: any free port)"
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return (
                f"port {port} on {host} is already in use (another Kestrel, web UI or server "
                f"is running there): stop it, or choose another port with {flag}, "
                f"e.g. {flag} {_suggest(host, port)}"
            )
        if e.errno == errno.EACCES:
            return (
                f"port {port} on {host}: permission denied (ports below 1024 need root); "
                f"choose another with {flag}"
            )
        return f"cannot serve on {host}:{port} ({e.strerror or e}); check the host or {flag}"
    finally:
        sock.close()
    return None


def _suggest(host: str, port: int) -> int:
    """A nearby port that is free now (the next few after `port`), else port + 1."""
    for candidate in range(port + 1, min(port + 20, 65536)):
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, candidate))
            return candidate
        except OSError:
            continue
        finally:
            sock.close()
    return port + 1
