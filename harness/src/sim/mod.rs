//! (placeholder: sim lands with its issue)
