"""`taps bench`: wall-clock speed of the proposers against plain decoding and peer methods, and its report."""
