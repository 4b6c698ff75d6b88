//! (placeholder: train lands with its issue)
