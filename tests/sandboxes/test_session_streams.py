"""A persistent session keeps its own streams: a command that redirects or closes the shell's
stdout or stderr (``exec 2>&1``, ``exec >&-``) cannot take the end markers with it, so the next
command answers with its own output and exit code instead of running out its time."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.backends("bwrap", "unshare", "docker")  # one PipeSession for all

REDIRECTS = [
    "exec 2>&1",
    "exec 2>/dev/null",
    "exec 2>&-",
    "exec 1>/dev/null",
    "exec >&-",
    "exec 1>&2",
    "exec 1>/dev/null 2>&1",
]


def test_a_command_that_redirects_the_shells_streams_leaves_the_next_one_intact(
    make_sandbox_for,
):
    sb = make_sandbox_for()
    with sb.session("bash") as shell:
        assert shell.run("cd /tmp && X=kept").ok
        for redirect in REDIRECTS:
            assert shell.run(redirect).exit_code == 0, redirect
            r = shell.run("echo ok; echo $X $PWD; echo oops >&2")
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (
                0,
                "ok\nkept /tmp\n",
                "oops\n",
                False,
            ), redirect
        # the redirect lasts for the rest of its own command, as in any shell
        r = shell.run("exec 2>&1; echo to-err >&2")
        assert (r.stdout, r.stderr) == ("to-err\n", "")
        assert shell.restarts == 0, "state must survive: nothing needed a restart"


def test_a_finished_command_whose_stderr_marker_never_comes_restarts_the_interpreter(
    make_sandbox_for,
):
    """Past what a command can do by accident (here a cell points the driver's saved stderr at
    /dev/null): the exit status came, so the command is not reported killed after waiting out
    its time; the interpreter restarts and says so, and the next command runs normally."""
    sb = make_sandbox_for()
    with sb.session("python") as py:
        r = py.run(
            "import os, sys\n"
            "os.dup2(os.open(os.devnull, os.O_WRONLY), sys.modules['__main__'].saved_err)\n"
            "print('done')"
        )
        assert (r.exit_code, r.stdout, r.timed_out) == (0, "done\n", False), r
        assert "session restarted" in r.stderr and py.restarts == 1
        r = py.run("print('ok')")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "ok\n", "", False)


def test_a_python_cell_that_redirects_fd_1_and_2_leaves_the_next_one_intact(make_sandbox_for):
    sb = make_sandbox_for()
    with sb.session("python") as py:
        assert py.run("import os, sys\nx = 41").ok
        r = py.run("null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2)")
        assert r.exit_code == 0 and not r.timed_out, r
        r = py.run("print(x + 1); print('oops', file=sys.stderr)")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "42\n", "oops\n", False)
        assert py.restarts == 0
