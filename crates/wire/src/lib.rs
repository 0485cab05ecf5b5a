//! Protocol knowledge shared by Stitch's apps and drivers, kept out of the engine core:
//! Internet checksums and offload handling (virtio-net header, checksum completion, GSO
//! segmentation).

pub mod checksum;
pub mod offload;
