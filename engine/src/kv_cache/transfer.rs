//! Transfers between a cache held as tensors and host memory, for the copies between the tiers.
//!
//! On a GPU (the `cuda` feature) they run on a copy stream of their own, from and into pinned
//! host buffers, and are ordered against the compute stream by events alone: the host queues a
//! download and goes on, and waits only when it needs the bytes in the host tier; an upload
//! arrives in parts, and the compute stream waits for a part only where the step first uses it.
//! Elsewhere (the CPU, which runs the device path in tests) they are plain copies, done at once.

use candle_core::{Device, Tensor};

use crate::Result;

/// The largest transfer, in bytes: a run of copies is split into parts this size at most, each
/// with a staging tensor on the device (outside the KV budget) and a pinned host buffer.
pub const MAX_TRANSFER_BYTES: usize = 32 << 20;

/// Transfers under way each way at most: a longer run waits for the older parts before it
/// starts another, so that staging never takes more than this many parts of memory.
pub const MAX_IN_FLIGHT: usize = 2;

/// Moves tensors between a device and the host.
pub enum Copier {
    /// Copies done when asked.
    Direct,
    #[cfg(feature = "cuda")]
    Stream(gpu::StreamCopier),
}

/// Bytes on their way to the host.
pub enum Download {
    Done(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pending(gpu::PendingDownload),
}

/// A tensor on the device whose parts (along its first dimension, in groups of `part_len`) arrive
/// from the host one after the other.
pub struct Upload {
    pub data: Tensor,
    #[cfg(feature = "cuda")]
    arrivals: Vec<gpu::Event>,
}

impl Copier {
    pub fn for_device(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = device {
            return Ok(Self::Stream(gpu::StreamCopier::new(gpu)?));
        }
        let _ = device;
        Ok(Self::Direct)
    }

    /// Starts bringing `data`, f32 on the device, to the host. Operations queued on the device
    /// after this call cannot change what arrives.
    pub fn download(&mut self, data: Tensor) -> Result<Download> {
        match self {
            Self::Direct => Ok(Download::Done(data.flatten_all()?.to_vec1()?)),
            #[cfg(feature = "cuda")]
            Self::Stream(s) => Ok(Download::Pending(s.download(data)?)),
        }
    }

    /// Waits for `download` and hands its bytes to `land`.
    pub fn finish(&mut self, download: Download, land: impl FnOnce(&[f32])) -> Result<()> {
        match download {
            Download::Done(data) => land(&data),
            #[cfg(feature = "cuda")]
            Download::Pending(pending) => match self {
                Self::Stream(s) => s.finish(pending, land)?,
                Self::Direct => {
                    return Err(crate::EngineError::Device(
                        "a transfer finished by another copier".into(),
                    ))
                }
            },
        }
        Ok(())
    }

    /// Starts an upload into a new `[parts, rows, cols]` tensor on `device`, from the values
    /// `fill` writes (in that layout) into host memory; part `i` may be used once
    /// [`Copier::arrived`] has been called for it.
    pub fn upload(
        &mut self,
        device: &Device,
        (parts, rows, cols): (usize, usize, usize),
        fill: impl FnOnce(&mut [f32]),
    ) -> Result<Upload> {
        let dims = (parts, rows, cols);
        match self {
            Self::Direct => {
                let mut data = vec![0f32; parts * rows * cols];
                fill(&mut data);
                Ok(Upload {
                    data: Tensor::from_vec(data, dims, device)?,
                    #[cfg(feature = "cuda")]
                    arrivals: Vec::new(),
                })
            }
            #[cfg(feature = "cuda")]
            Self::Stream(s) => s.upload(dims, fill),
        }
    }

    /// Makes the device wait, before what is queued next, for part `part` of `upload`.
    pub fn arrived(&self, upload: &Upload, part: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Self::Stream(s) = self {
            s.arrived(upload, part)?;
        }
        let _ = (upload, part);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{
        sys::CUevent_flags, CudaEvent, CudaStream, PinnedHostSlice,
    };
    use candle_core::cuda_backend::WrapErr;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, Storage, Tensor};

    use super::Upload;
    use crate::{EngineError, Result};

    pub type Event = CudaEvent;

    /// Pinned buffers kept for reuse at most.
    const KEPT_BUFFERS: usize = 8;

    pub struct StreamCopier {
        gpu: CudaDevice,
        compute: Arc<CudaStream>,
        copy: Arc<CudaStream>,
        free: Vec<Staging>,
    }

    /// A pinned host buffer, and the event after which the transfers using it are over.
    struct Staging {
        buffer: PinnedHostSlice<f32>,
        done: Option<CudaEvent>,
    }

    impl Staging {
        fn is_free(&self) -> bool {
            self.done.as_ref().is_none_or(CudaEvent::is_complete)
        }
    }

    impl Drop for Staging {
        fn drop(&mut self) {
            // The buffer is freed after this: never under a transfer.
            if let Some(done) = &self.done {
                let _ = done.synchronize();
            }
        }
    }

    pub struct PendingDownload {
        /// Dropped first: its drop waits for the copy, so that `_source` outlives it.
        staging: Staging,
        /// Kept alive (its memory not reused by the compute stream) until the copy is over.
        _source: Tensor,
        len: usize,
    }

    fn driver(what: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Device(format!("{what}: {e}"))
    }

    impl Drop for StreamCopier {
        fn drop(&mut self) {
            // Whatever is still under way finishes before the tensors and buffers it uses go.
            let _ = self.copy.synchronize();
        }
    }

    impl StreamCopier {
        pub fn new(gpu: &CudaDevice) -> Result<Self> {
            let compute = gpu.cuda_stream();
            let copy = compute
                .context()
                .new_stream()
                .map_err(|e| driver("creating the copy stream", e))?;
            Ok(Self {
                gpu: gpu.clone(),
                compute,
                copy,
                free: Vec::new(),
            })
        }

        /// An event on the compute stream, so far.
        fn compute_so_far(&self) -> Result<CudaEvent> {
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            self.compute.record_event(flags).w().map_err(Into::into)
        }

        fn copy_so_far(&self) -> Result<CudaEvent> {
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            self.copy.record_event(flags).w().map_err(Into::into)
        }

        /// A pinned buffer of at least `len` values, no transfer still using it: a kept one
        /// whose transfers are over, else a new one.
        fn staging(&mut self, len: usize) -> Result<Staging> {
            let fits = self
                .free
                .iter()
                .position(|s| s.buffer.len() >= len && s.is_free());
            let staging = match fits {
                Some(i) => self.free.swap_remove(i),
                None => {
                    let ctx = self.compute.context();
                    // Flags 0: readable by the host at full speed (write-combined is not).
                    // SAFETY: f32 is valid for any bits; the buffer is written before it is read.
                    let size = len.next_power_of_two();
                    let buffer = unsafe { ctx.alloc_pinned_with_flags::<f32>(size, 0) }
                        .map_err(|e| driver("allocating a pinned host buffer", e))?;
                    Staging { buffer, done: None }
                }
            };
            if let Some(done) = &staging.done {
                done.synchronize().w()?;
            }
            Ok(staging)
        }

        /// Keeps `staging` for reuse, making room by dropping a kept buffer no transfer uses
        /// (a drop waits for its transfers; this never does).
        fn recycle(&mut self, staging: Staging) {
            if self.free.len() >= KEPT_BUFFERS {
                if let Some(i) = self.free.iter().position(Staging::is_free) {
                    self.free.swap_remove(i);
                }
            }
            self.free.push(staging);
        }

        /// The host memory of `staging`, `len` values.
        fn host(staging: &mut Staging, len: usize) -> Result<&mut [f32]> {
            let ptr = staging.buffer.as_mut_ptr().w()?;
            // SAFETY: `len <= buffer.len()`; no transfer uses the buffer (see `staging`).
            Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
        }

        pub fn download(&mut self, data: Tensor) -> Result<PendingDownload> {
            let data = data.contiguous()?;
            let len = data.elem_count();
            let mut staging = self.staging(len)?;
            // The copy starts after what the compute stream has queued (the gather that made
            // `data`), and the compute stream does not wait for it.
            self.copy.wait(&self.compute_so_far()?).w()?;
            {
                let (storage, layout) = data.storage_and_layout();
                let Storage::Cuda(storage) = &*storage else {
                    return Err(driver("download", "the tensor is not on the GPU"));
                };
                let start = layout.start_offset();
                let source = storage.as_cuda_slice::<f32>()?.slice(start..start + len);
                let host = Self::host(&mut staging, len)?;
                self.copy.memcpy_dtoh(&source, host).w()?;
            }
            staging.done = Some(self.copy_so_far()?);
            Ok(PendingDownload {
                staging,
                _source: data,
                len,
            })
        }

        pub fn finish(
            &mut self,
            mut pending: PendingDownload,
            land: impl FnOnce(&[f32]),
        ) -> Result<()> {
            if let Some(done) = pending.staging.done.take() {
                done.synchronize().w()?;
            }
            land(Self::host(&mut pending.staging, pending.len)?);
            self.recycle(pending.staging);
            Ok(())
        }

        pub fn upload(
            &mut self,
            (parts, rows, cols): (usize, usize, usize),
            fill: impl FnOnce(&mut [f32]),
        ) -> Result<Upload> {
            let (part_len, len) = (rows * cols, parts * rows * cols);
            let mut staging = self.staging(len)?;
            fill(Self::host(&mut staging, len)?);
            // SAFETY: every value is written by the copies below, which the compute stream
            // waits for before it reads a part.
            let mut target = unsafe { self.gpu.alloc::<f32>(len)? };
            // The allocation is ordered on the compute stream; the copies follow it.
            self.copy.wait(&self.compute_so_far()?).w()?;
            let mut arrivals = Vec::with_capacity(parts);
            for part in 0..parts {
                let span = part * part_len..(part + 1) * part_len;
                let host = &Self::host(&mut staging, len)?[span.clone()];
                self.copy
                    .memcpy_htod(host, &mut target.slice_mut(span))
                    .w()?;
                arrivals.push(self.copy_so_far()?);
            }
            staging.done = Some(self.copy_so_far()?);
            self.recycle(staging);
            let storage = CudaStorage::wrap_cuda_slice(target, self.gpu.clone());
            let data = Tensor::from_storage(
                Storage::Cuda(storage),
                (parts, rows, cols),
                BackpropOp::none(),
                false,
            );
            Ok(Upload { data, arrivals })
        }

        pub fn arrived(&self, upload: &Upload, part: usize) -> Result<()> {
            if let Some(event) = upload.arrivals.get(part) {
                self.compute.wait(event).w()?;
            }
            Ok(())
        }
    }
}
