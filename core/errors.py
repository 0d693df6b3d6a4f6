"""The one base class of user-facing errors: a problem the user can fix, whose message is the whole story.

Entry scripts print such an error as one line (``error: ...``) and exit 2. Every package's user errors subclass
it, so the entry needs no list of error types.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, data, paths, run directory) described in one line."""
