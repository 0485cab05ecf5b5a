//! Where functions find Stitch by default: the attach socket, beside the runtime folder.

use std::path::PathBuf;

/// The default attach socket: `nf.sock` in [`default_socket_folder`].
pub fn default_socket() -> PathBuf {
    default_socket_folder().join("nf.sock")
}

/// The folder of the default attach socket: `/run/stitch-fn` for root — beside the runtime
/// folder, not in it: functions run as other users, who may not enter `/run/stitch` — else the
/// user's runtime folder.
pub fn default_socket_folder() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/run/stitch-fn")
    } else {
        stitch_core::runtime_dir()
    }
}
