//! The sans-IO protocol core: wire formats, the completion tracker, the PP vote board and the
//! transfer planner. Nothing here does I/O or reads a clock; time comes in as an argument.
