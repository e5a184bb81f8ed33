"""Run a Python program as a process of another host would, on a filesystem whose file locks are local to each
client (NFS with `local_lock=all`): `python tests/other_host.py HOST [--clock-offset SECONDS] PROGRAM [ARGS...]` or
`python tests/other_host.py HOST [--clock-offset SECONDS] -c CODE`. `socket.gethostname()` answers HOST and
`fcntl.flock` always succeeds (a lock that another host never sees); with `--clock-offset`, `time.time()` runs that
many seconds ahead (negative: behind), as the clock of a host that NTP does not keep right. The kernel's clock (file
times) is left alone, as on a shared filesystem whose server keeps its own. Everything else runs as it is."""

import fcntl
import runpy
import socket
import sys
import time

host = sys.argv[1]
socket.gethostname = lambda: host
fcntl.flock = lambda fd, operation: None
args = sys.argv[2:]
if args[0] == "--clock-offset":
    offset = float(args[1])
    args = args[2:]
    real_time = time.time
    time.time = lambda: real_time() + offset
if args[0] == "-c":
    code = args[1]
    sys.argv = ["-c", *args[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = args
    runpy.run_path(sys.argv[0], run_name="__main__")
