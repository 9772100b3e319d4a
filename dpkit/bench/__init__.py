"""``dpkit bench``: DDP, ZeRO-1 and ZeRO-2 side by side, with bare torch/DeepSpeed twins.

* :mod:`~dpkit.bench.cli`: the command (flags, settings checked before launching, main);
* :mod:`~dpkit.bench.launch`: the phases, their commands and launchers, running them;
* :mod:`~dpkit.bench.results`: each run's files read back, summaries, comparisons, checks;
* :mod:`~dpkit.bench.markdown`: ``results.md``; :mod:`~dpkit.bench.chart`: ``chart.png``;
* :mod:`~dpkit.bench.machine`: the machine, versions and git revision recorded;
* launched scripts: :mod:`~dpkit.bench.bare_ddp` (torchrun), :mod:`~dpkit.bench.bare_deepspeed`
  (deepspeed), :mod:`~dpkit.bench.collectives` (torchrun).

Imports go one way: cli -> launch, results, markdown, chart, machine; results -> launch;
markdown -> results; chart -> launch, results, markdown.
"""
