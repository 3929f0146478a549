"""Start-up cost (asv): what a user waits for before kvbench does any work.

- `timeraw_import_kvbench`, `timeraw_import_cli`: `import kvbench` / `import kvbench.cli` in a fresh
  interpreter (asv's `timeraw_*` runs the code in a new process and times it; interpreter start excluded).
- `CliStart.time_cli`: the whole process `python -c "from kvbench.cli import main; main()" ARGS` (what the
  `kvbench` console script runs), interpreter start included: `--help` (the command group) and
  `replay --help` (which loads the backends through their entry points to list their options).
"""

import subprocess
import sys


def timeraw_import_kvbench():
    return "import kvbench"


def timeraw_import_cli():
    return "import kvbench.cli"


class CliStart:
    params = ["--help", "replay --help"]
    param_names = ["args"]
    number = 1
    repeat = (3, 10, 20.0)
    timeout = 120

    def setup(self, args):
        self.cmd = [sys.executable, "-c", "from kvbench.cli import main; main()", *args.split()]
        subprocess.run(self.cmd, check=True, capture_output=True)  # warm the OS file cache and .pyc files

    def time_cli(self, args):
        subprocess.run(self.cmd, check=True, capture_output=True)
