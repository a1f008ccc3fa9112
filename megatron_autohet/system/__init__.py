"""Process and operating-system helpers with no torch, any layer may use: a free local TCP port
(``ports``), a process that dies with its parent (``parent_death``)."""
