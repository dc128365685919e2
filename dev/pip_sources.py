"""pip's configured package sources (pip.conf and PIP_* variables: index-url, extra-index-url, find-links) as uv pip
install flags, one per line, so dev/setup_env.sh's uv installs from where pip would (a local wheel of torch included).
No package needed: it asks `pip config list`, whose lines read `scope.key='value'`."""

import os
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def sources(listing):
    pairs = {}  # (flag, source) in first-seen order: a source set in two scopes is passed once
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        for item in value.strip().strip("'\"").split() if name in FLAGS else []:
            pairs[FLAGS[name], item] = None
    return [part for pair in pairs for part in pair]


if __name__ == "__main__":
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}).stdout
    print("\n".join(sources(listing)))
