"""`python -m flash_ext.benchmark`: flash_ext timed against FA3, SDPA and Flex on one grid of shapes.

    shapes     Shape, the FLOP convention
    records    backend names, statuses, Record
    backends   the timed backends (flash_ext, FA3, SDPA cuDNN/flash/mem-eff/math, Flex)
    check      the float64 reference on a slice, tolerances, the verdict
    timing     do_bench and CPU timers, peak memory
    progress   the progress display
    runner     inputs and the per-shape loop
    env        GPU / driver / versions / git environment
    report     ratios to the best SDPA backend, terminal tables
    jsonfile   the JSON results file
    plot       the PNG plot
    cli        options, the grid, main

See benchmarks/README.md.
"""
