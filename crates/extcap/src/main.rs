//! `stitch-extcap`: Wireshark's external capture interface for Stitch. Every link of every
//! running instance on this host (the API sockets in Stitch's runtime folder) is a capture
//! interface named `stitch:INSTANCE:APP.PORT>APP.PORT`, so `tshark -D` lists them and
//! `tshark -i 'stitch:default:fw.output>out.input'` or Wireshark's interface list captures them.
//! Wireshark runs this program with the options of its extcap protocol (see `extcap(4)`); the
//! capture itself is the instance's live link capture (`GET /api/v1/links/{link}/capture`),
//! written to the FIFO Wireshark names. The links of each kernel data plane (`stitch kernel
//! apply`) are interfaces too, named `stitch-kernel:PLANE:APP.PORT>APP.PORT`: those are tapped
//! in the kernel and read by this program itself (it needs the rights `stitch kernel` needs).
//! `stitch-extcap --install` links it into Wireshark's extcap folder.

use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use stitch_api::client::{self, CaptureRequest, Method};
use stitch_io::link_capture::CaptureOptions;
use stitch_kernel::capture::KernelLinkCapture;
use stitch_kernel::DataPlane;

const PREFIX: &str = "stitch:";
const KERNEL_PREFIX: &str = "stitch-kernel:";

/// Where an interface's link runs.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    /// A running instance, by name.
    Instance(String),
    /// A kernel data plane, by name.
    Kernel(String),
}

/// The options Wireshark passes, as `--name value` or `--name=value`, and flags.
struct Options {
    values: HashMap<String, String>,
    flags: Vec<String>,
}

const TAKES_VALUE: [&str; 7] = [
    "--extcap-interface",
    "--extcap-version",
    "--fifo",
    "--extcap-capture-filter",
    "--snaplen",
    "--extcap-control-in",
    "--extcap-control-out",
];

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        values: HashMap::new(),
        flags: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some((k, v)) = a.split_once('=') {
            o.values.insert(k.to_string(), v.to_string());
        } else if TAKES_VALUE.contains(&a.as_str()) {
            let v = it.next().ok_or_else(|| anyhow!("{a} needs a value"))?;
            o.values.insert(a.clone(), v.clone());
        } else {
            o.flags.push(a.clone());
        }
    }
    Ok(o)
}

impl Options {
    fn flag(&self, f: &str) -> bool {
        self.flags.iter().any(|x| x == f)
    }
    fn value(&self, k: &str) -> Option<&str> {
        self.values.get(k).map(String::as_str)
    }
}

/// The running instances: name and API socket.
fn instances() -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(stitch_core::runtime_dir())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let name = p.file_name()?.to_str()?.strip_suffix(".sock")?.to_string();
            Some((name, p))
        })
        .collect();
    found.sort();
    found
}

/// The interface name of a link (`a.x -> b.y`) of `source`.
fn interface_name(source: &Source, link: &str) -> String {
    let link = link.replace(" -> ", ">");
    match source {
        Source::Instance(i) => format!("{PREFIX}{i}:{link}"),
        Source::Kernel(p) => format!("{KERNEL_PREFIX}{p}:{link}"),
    }
}

/// Source and link selector of an interface name.
fn parse_interface(name: &str) -> Result<(Source, String)> {
    let (rest, kernel) = match name.strip_prefix(KERNEL_PREFIX) {
        Some(r) => (r, true),
        None => (
            name.strip_prefix(PREFIX).ok_or_else(|| {
                anyhow!(
                    "`{name}` is not a Stitch interface (they start with {PREFIX} or {KERNEL_PREFIX})"
                )
            })?,
            false,
        ),
    };
    let (owner, link) = rest
        .split_once(':')
        .ok_or_else(|| anyhow!("`{name}`: expected {PREFIX}INSTANCE:APP.PORT>APP.PORT"))?;
    let source = if kernel {
        Source::Kernel(owner.to_string())
    } else {
        Source::Instance(owner.to_string())
    };
    Ok((source, link.replace('>', " -> ")))
}

fn list_interfaces() {
    println!("extcap {{version={}}}", env!("CARGO_PKG_VERSION"));
    for (instance, socket) in instances() {
        // A socket left by a dead instance does not answer: it has no links to offer.
        let Ok(links) = client::json(&socket, Method::GET, "/api/v1/links", None) else {
            continue;
        };
        for l in links.as_array().into_iter().flatten() {
            let Some(link) = l["link"].as_str() else {
                continue;
            };
            println!(
                "interface {{value={}}}{{display=Stitch {instance}: {link}}}",
                interface_name(&Source::Instance(instance.clone()), link)
            );
        }
    }
    for plane in DataPlane::installed_names() {
        let Ok(links) = DataPlane::new(&plane).and_then(|p| p.tappable_links()) else {
            continue;
        };
        for (decl, _) in links {
            let link = decl.spec();
            println!(
                "interface {{value={}}}{{display=Stitch kernel {plane}: {link}}}",
                interface_name(&Source::Kernel(plane.clone()), &link)
            );
        }
    }
}

fn capture(o: &Options) -> Result<()> {
    let interface = o
        .value("--extcap-interface")
        .ok_or_else(|| anyhow!("--capture needs --extcap-interface"))?;
    let fifo = o
        .value("--fifo")
        .ok_or_else(|| anyhow!("--capture needs --fifo"))?;
    let (source, link) = parse_interface(interface)?;
    let snaplen = o
        .value("--snaplen")
        .map(|s| s.parse::<u32>().context("--snaplen"))
        .transpose()?;
    let filter = o.value("--extcap-capture-filter").map(str::to_string);
    // Wireshark ends an extcap capture with SIGTERM (SIGINT from a terminal).
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let open_fifo = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(fifo)
            .with_context(|| format!("cannot open {fifo}"))
    };
    match source {
        Source::Instance(instance) => {
            let socket = stitch_api::socket_path(&instance);
            let request = CaptureRequest {
                format: Some("pcapng".into()),
                snaplen,
                filter,
                ..Default::default()
            };
            let mut out = open_fifo()?;
            client::capture_link(&socket, &link, &request, &stop, &mut out, true, || {})?;
        }
        Source::Kernel(plane) => {
            let mut options = CaptureOptions {
                filter,
                ..CaptureOptions::default()
            };
            if let Some(s) = snaplen {
                options.snaplen = s;
            }
            let capture = KernelLinkCapture::start(&plane, &link, options)?;
            let mut out = open_fifo()?;
            capture.stream(&mut out, &stop, true)?;
        }
    }
    Ok(())
}

/// Links this program into Wireshark's extcap folder (the one `tshark -G folders` names, or
/// `dir`).
fn install(dir: Option<&str>) -> Result<()> {
    let dir = match dir {
        Some(d) => PathBuf::from(d),
        None => {
            let out = std::process::Command::new("tshark")
                .args(["-G", "folders"])
                .output()
                .context("running `tshark -G folders` to find Wireshark's extcap folder (or give it: --install DIR)")?;
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| {
                    l.strip_prefix("Extcap path:")
                        .map(|p| PathBuf::from(p.trim()))
                })
                .ok_or_else(|| {
                    anyhow!("`tshark -G folders` names no extcap path; give it: --install DIR")
                })?
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let me = std::env::current_exe()?.canonicalize()?;
    let at = dir.join("stitch-extcap");
    let _ = std::fs::remove_file(&at);
    std::os::unix::fs::symlink(&me, &at)
        .with_context(|| format!("cannot link {} to {}", at.display(), me.display()))?;
    println!("{} -> {}", at.display(), me.display());
    Ok(())
}

fn run(args: &[String]) -> Result<()> {
    if let Some(i) = args.iter().position(|a| a == "--install") {
        return install(args.get(i + 1).map(String::as_str));
    }
    let o = parse(args)?;
    if o.flag("--extcap-interfaces") {
        list_interfaces();
    } else if o.flag("--extcap-dlts") {
        let interface = o.value("--extcap-interface").unwrap_or_default();
        parse_interface(interface)?;
        println!("dlt {{number=1}}{{name=EN10MB}}{{display=Ethernet}}");
    } else if o.flag("--extcap-config") {
        println!("arg {{number=0}}{{call=--snaplen}}{{display=Snapshot length}}{{tooltip=Bytes kept of each packet}}{{type=integer}}{{range=1,262144}}{{default=262144}}");
    } else if o.flag("--capture") {
        capture(&o)?;
    } else if let Some(f) = o.value("--extcap-capture-filter") {
        // Wireshark checks a capture filter as it is typed: the instance compiles it.
        match parse_interface(o.value("--extcap-interface").unwrap_or_default())? {
            (Source::Instance(instance), link) => {
                check_filter(&stitch_api::socket_path(&instance), &link, f)?
            }
            (Source::Kernel(_), _) => stitch_kernel::capture::check_filter(f)?,
        }
    } else {
        bail!("usage: stitch-extcap --extcap-interfaces | --extcap-interface IF (--extcap-dlts | --extcap-config | --capture --fifo PATH [--extcap-capture-filter F] [--snaplen N]) | --install [DIR]");
    }
    Ok(())
}

/// Checks a filter by asking for a capture of nothing (count 0), which compiles it.
fn check_filter(socket: &Path, link: &str, filter: &str) -> Result<()> {
    let request = CaptureRequest {
        count: Some(0),
        filter: Some(filter.to_string()),
        ..Default::default()
    };
    let never = AtomicBool::new(false);
    client::capture_link(
        socket,
        link,
        &request,
        &never,
        &mut std::io::sink(),
        false,
        || {},
    )?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("stitch-extcap: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_round_trip() {
        let n = interface_name(&Source::Instance("lab-1".into()), "fw.output -> out.input");
        assert_eq!(n, "stitch:lab-1:fw.output>out.input");
        assert_eq!(
            parse_interface(&n).unwrap(),
            (
                Source::Instance("lab-1".into()),
                "fw.output -> out.input".to_string()
            )
        );
        let k = interface_name(&Source::Kernel("dp".into()), "a.output -> f.input");
        assert_eq!(k, "stitch-kernel:dp:a.output>f.input");
        assert_eq!(
            parse_interface(&k).unwrap(),
            (
                Source::Kernel("dp".into()),
                "a.output -> f.input".to_string()
            )
        );
        assert!(parse_interface("eth0").is_err());
        assert!(parse_interface("stitch:nolink").is_err());
    }

    #[test]
    fn options_in_both_spellings() {
        let args: Vec<String> = [
            "--capture",
            "--extcap-interface=stitch:a:x.o>y.i",
            "--fifo",
            "/tmp/f",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let o = parse(&args).unwrap();
        assert!(o.flag("--capture"));
        assert_eq!(o.value("--extcap-interface"), Some("stitch:a:x.o>y.i"));
        assert_eq!(o.value("--fifo"), Some("/tmp/f"));
    }
}
