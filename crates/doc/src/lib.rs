//! Stitch's references generated from the code, so that they cannot drift from it: the apps'
//! settings (`docs/apps.md`, from the config types' schemas and doc comments), the man pages
//! and the shell completions (from the command's clap definition).

mod apps;

pub use apps::apps_reference;
mod manual;

pub use clap_complete::Shell;
pub use manual::{completion, write_man_pages};
