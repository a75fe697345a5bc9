"""lightning_mp's test suite: a package, so that its helpers import as ``tests.helpers`` under every import mode."""
