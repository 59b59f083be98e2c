"""Routes of kernels_lib's losses that are not the default (they have not won a same-run A/B on a GPU),
carried by the studies and put in place only for the calls an A/B arm makes (:func:`studies.bench.arms.constants_set`)."""
