"""Run a Python program as a process of another host would, on a filesystem whose file locks are local to each
client (NFS with `local_lock=all`): `python tests/other_host.py HOST PROGRAM [ARGS...]` or
`python tests/other_host.py HOST -c CODE`. `socket.gethostname()` answers HOST and `fcntl.flock` always succeeds
(a lock that another host never sees); everything else runs as it is."""

import fcntl
import runpy
import socket
import sys

host = sys.argv[1]
socket.gethostname = lambda: host
fcntl.flock = lambda fd, operation: None
if sys.argv[2] == "-c":
    code = sys.argv[3]
    sys.argv = ["-c", *sys.argv[4:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
