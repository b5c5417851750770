"""The CLI's one line for an OSError on a path the user can fix (the subprocess tests in
tests/integration/test_first_hour.py run the real commands; these cover the errnos a
root CI run cannot provoke: permissions, a full disk)."""

from __future__ import annotations

import errno
import os

from launcher.cli import filesystem_error


def _error(code: int, filename: str | None) -> OSError:
    return OSError(code, os.strerror(code), filename)


def test_unwritable_and_full_name_the_path_and_the_fix():
    assert filesystem_error(_error(errno.EACCES, "/srv/data/logs")) == (
        "cannot write /srv/data/logs: Permission denied (the data dir must be writable: "
        "fix its permissions, or pick another folder with --set data_dir=DIR)"
    )
    assert filesystem_error(_error(errno.ENOSPC, "/srv/data/areal.db")) == (
        "cannot write /srv/data/areal.db: No space left on device (the data dir must be "
        "writable: free some space, or pick another folder with --set data_dir=DIR)"
    )


def test_a_file_in_place_of_the_folder_is_named(tmp_path):
    (tmp_path / "data").write_text("")
    assert filesystem_error(_error(errno.EEXIST, str(tmp_path / "data"))) == (
        f"{tmp_path / 'data'} is a file, not a folder (is data_dir right? pick another "
        "folder with --set data_dir=DIR)"
    )


def test_other_os_errors_keep_their_traceback():
    assert filesystem_error(_error(errno.ECONNREFUSED, None)) is None
    assert filesystem_error(_error(errno.EACCES, None)) is None  # no path to name
    assert filesystem_error(_error(errno.EBADF, "/dev/null")) is None
