// A small time-series line chart on a <canvas>: a y grid with labels, one line per series.

export const PALETTE = [
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

const PAD = { left: 52, right: 10, top: 8, bottom: 18 };

export class LineChart {
  /**
   * @param canvas the <canvas> to draw on (sized by CSS; drawn at device pixels)
   * @param format value -> axis label (default: the number, compact)
   * @param fixedMax the top of the y axis, or null to fit the data
   * @param minMax the lowest top when fitting (e.g. 2 for counts, so no "0.5 requests")
   */
  constructor(canvas, { format = compact, fixedMax = null, minMax = 0, gapMs = 3500 } = {}) {
    this.canvas = canvas;
    this.format = format;
    this.fixedMax = fixedMax;
    this.minMax = minMax;
    this.gapMs = gapMs; // samples further apart than this are not joined (tab was hidden)
  }

  /** series: [{color, points: [[timeMs, value], ...]}], drawn over [now - windowMs, now]. */
  draw(series, now, windowMs) {
    const { canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const style = getComputedStyle(document.documentElement);
    const gridColor = style.getPropertyValue("--grid").trim() || "#ddd";
    const textColor = style.getPropertyValue("--muted").trim() || "#666";
    const start = now - windowMs;
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;

    let top = this.fixedMax;
    if (top === null) {
      let max = 0;
      for (const s of series) for (const [t, v] of s.points) if (t >= start) max = Math.max(max, v);
      top = niceCeil(Math.max(max, this.minMax));
    }
    const x = (t) => PAD.left + ((t - start) / windowMs) * plotW;
    const y = (v) => PAD.top + plotH - (Math.min(v, top) / top) * plotH;

    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (const fraction of [0, 0.25, 0.5, 0.75, 1]) {
      const gy = Math.round(y(top * fraction)) + 0.5;
      ctx.strokeStyle = gridColor;
      ctx.beginPath();
      ctx.moveTo(PAD.left, gy);
      ctx.lineTo(width - PAD.right, gy);
      ctx.stroke();
      if (fraction % 0.5 === 0) {
        ctx.fillStyle = textColor;
        ctx.fillText(this.format(top * fraction), PAD.left - 6, gy);
      }
    }
    ctx.textBaseline = "alphabetic";
    ctx.textAlign = "left";
    ctx.fillText(`−${Math.round(windowMs / 1000)} s`, PAD.left, height - 4);
    ctx.textAlign = "right";
    ctx.fillText("now", width - PAD.right, height - 4);

    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.beginPath();
      let previous = null;
      for (const [t, v] of s.points) {
        if (t < start) continue;
        if (previous === null || t - previous > this.gapMs) ctx.moveTo(x(t), y(v));
        else ctx.lineTo(x(t), y(v));
        previous = t;
      }
      ctx.stroke();
      // The latest value as a dot, so a single sample is visible too.
      const last = s.points[s.points.length - 1];
      if (last && last[0] >= start) {
        ctx.beginPath();
        ctx.arc(x(last[0]), y(last[1]), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  }
}

/** The smallest {1, 2, 4, 6, 8} × 10^k at or above v (1 for an empty chart): halves stay round. */
export function niceCeil(v) {
  if (!(v > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 4, 6, 8, 10]) if (m * power >= v * 0.999999) return m * power;
  return 10 * power;
}

/** A number in at most three significant digits, without trailing zeros. */
export function compact(v) {
  return String(Number(v.toPrecision(3)));
}
