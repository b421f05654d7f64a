"""forewarn's own daemons as child processes, for the demo, the chaos lab and the tests.

* :mod:`forewarn.spawn.commands`: the command lines of ``forewarn collector`` and
  ``forewarn agent`` and their flat TOML configs;
* :mod:`forewarn.spawn.procs`: the process table (:class:`~forewarn.spawn.procs.Procs`, each
  process in a group of its own), stopping, and waiting until a daemon answers;
* :mod:`forewarn.spawn.interrupts`: Ctrl-C and SIGTERM held while a process is started and
  recorded;
* :mod:`forewarn.spawn.workload`: the training ranks the demo and the chaos lab run
  (``python -m``, named by the module's ``__name__`` so ``lint-imports`` sees who runs it).

It imports neither the demo nor the chaos lab (an import-linter contract): the demo is a
product feature and must not depend on the test lab.
"""

__all__: list[str] = []
