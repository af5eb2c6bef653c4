"""benchmarks/bench — the benchmark driver's package (benchmarks/run.py runs it; scripts/bench starts that).

  core.py       the context a suite runs in: paths, --quick, --dry-run, failures, the annotated JSON
                lines on stdout, processes, the Release build and the King James corpus
  steps.py      what a suite is made of: runs (a command and how its JSON line comes out), lines derived
                from the kept ones (ratios, summaries), and small set-up steps
  lines.py      the JSON lines made from runs' output and the ratio lines (pure functions)
  summaries.py  the longer summaries: planner's cost_model line, data's and dist's ratio lines
  suites/       the suites, as data: one module per family, SUITES (suites/__init__.py) in running order
"""
