//! Shared helpers of the kernel tests: a device with a kernel loaded, seeded inputs and
//! comparisons with commented tolerances.
