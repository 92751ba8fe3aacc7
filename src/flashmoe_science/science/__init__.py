"""Scientific workloads built on the library: ``supercon``, a composition transformer for superconductor critical
temperatures (SuperCon) and high-throughput screening of candidate compositions (``flashmoe-science supercon``)."""
