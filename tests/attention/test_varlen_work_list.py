"""A packed batch's work lists (seqlen.varlen_work_list, built by two Triton kernels): their exact integers and the
kernels' decoding of every work list, under the Triton interpreter (work_list_interpreter_check.py)."""

from pathlib import Path

from interpreter_driver import interpreter_suite, run_marked_suite


@interpreter_suite(Path(__file__).with_name("work_list_interpreter_check.py"))
def test_kernels_decode_the_work_lists_under_the_interpreter(request):
    run_marked_suite(request)
