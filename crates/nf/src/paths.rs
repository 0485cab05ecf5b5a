//! Where functions find Stitch by default: the attach socket, beside the runtime folder.

use std::path::PathBuf;

/// The instance `stitch run` is when not given `--name`.
pub const DEFAULT_INSTANCE: &str = "stitch";

/// The attach socket of the default instance ([`socket_of`] `stitch`): where a function looks
/// when it is given neither a socket nor an instance.
pub fn default_socket() -> PathBuf {
    socket_of(DEFAULT_INSTANCE)
}

/// The attach socket of instance `instance`'s function ports that name none: `INSTANCE.sock`
/// in [`default_socket_folder`], so that two instances with functions run side by side.
pub fn socket_of(instance: &str) -> PathBuf {
    let folder = default_socket_folder();
    let named = folder.join(format!("{instance}.sock"));
    // A Unix socket's path holds 107 bytes; a long key (`--control` of a deep path) is hashed.
    if named.as_os_str().len() <= 107 {
        return named;
    }
    folder.join(format!("fn-{:016x}.sock", name_hash(instance)))
}

/// A short, stable file-name part for a name of any length (FNV-1a): a socket's path holds
/// 107 bytes, and a name may be longer.
pub fn name_hash(instance: &str) -> u64 {
    instance.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The folder of the default attach sockets: `/run/stitch-fn` for root — beside the runtime
/// folder, not in it: functions run as other users, who may not enter `/run/stitch` — else
/// `fn` in the user's runtime folder (not the folder itself, where `INSTANCE.sock` is the
/// instance's API).
pub fn default_socket_folder() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/run/stitch-fn")
    } else {
        stitch_core::runtime_dir().join("fn")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_instance_has_its_own_socket_and_none_is_an_api_socket() {
        let a = socket_of("a");
        assert_ne!(a, socket_of("b"));
        assert_eq!(a.file_name().unwrap(), "a.sock");
        assert_ne!(a.parent().unwrap(), stitch_core::runtime_dir());
        let long = socket_of(&"x".repeat(200));
        assert!(long.as_os_str().len() <= 107, "{}", long.display());
        assert_ne!(long, socket_of(&"y".repeat(200)));
        assert_eq!(default_socket(), socket_of(DEFAULT_INSTANCE));
    }
}
