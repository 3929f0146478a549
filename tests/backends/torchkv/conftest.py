import importlib.util

if importlib.util.find_spec("torch") is None:  # the torch backend needs torch: pip install -e '.[torch]'
    collect_ignore_glob = ["test_*.py"]

# The traces these tests replay are heads of the samples: the session's `sample_head` (tests/conftest.py).
