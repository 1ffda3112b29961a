"""A module the fork server tests give it to import: it takes seconds, as torch does."""

import time

time.sleep(3.0)
