//! (placeholder: tasks lands with its issue)
