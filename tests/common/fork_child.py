"""What the fork server tests run in a child: it reports the process state it was given."""

import json
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    out, code = Path(sys.argv[1]), int(sys.argv[2])
    out.write_text(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORK_TEST"),
                               "sid": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
                               "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}))
    print("to the log", flush=True)
    if code < 0:
        time.sleep(60)  # until it is killed
    sys.exit(code)
